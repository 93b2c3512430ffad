"""Print the README's Params table from the DAG's own Param schemas (``--check`` compares)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BEGIN, END = "<!-- params-table:begin -->", "<!-- params-table:end -->"


def params_table() -> str:
    """A Markdown table: Param, its label and section in the trigger form, default, meaning (GPU/seed defaults, not the
    demo's; the whole help, where the form shows its first sentence and links here)."""
    from eagleflow.run.pipeline import param_schemas

    lines = ["| Param | Form label (section) | Default | Meaning |", "|---|---|---|---|"]
    for name, schema in param_schemas().items():
        default = schema.get("default")
        if name == "output_root":
            shown = "`$EAGLEFLOW_OUTPUT_ROOT`"
        elif default is None and name in ("model_path", "dataset_input"):
            shown = "required"
        else:
            shown = f"`{default!r}`" if default not in (None, []) else "—"
        text = schema.get("description", "").replace("|", "\\|")
        label = f"{schema['title']} ({schema.get('section', 'Run Parameters')})"
        lines.append(f"| `{name}` | {label} | {shown} | {text} |")
    return "\n".join(lines)


def main() -> int:
    table = params_table()
    readme = (REPO / "README.md").read_text()
    current = readme.split(BEGIN)[1].split(END)[0].strip() if BEGIN in readme else ""
    if "--check" in sys.argv:
        if current != table:
            print("README.md's Params table is out of date: run python scripts/params_table.py --write", file=sys.stderr)
            return 1
        return 0
    if "--write" in sys.argv:
        before, rest = readme.split(BEGIN)
        after = rest.split(END)[1]
        (REPO / "README.md").write_text(f"{before}{BEGIN}\n{table}\n{END}{after}")
        return 0
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
