"""An engine without a model: answers ``/generate`` at once and hands a prepared tensor of the
request's length to eagleflow's own :class:`~sglang_patch.dump_writer.DumpWriter`, which writes the
dump to the hand-off folder exactly as the capture hook does. What remains to measure is the
writer, the extractor, validation and publishing: the pipeline between an engine and the disk.

``python benchmarks/model_free_engine.py --dump-dir D --port P [--slots 4 --hidden 7168]``
(SGLang's native API subset: ``/generate``, ``/health``, ``/health_generate``, ``/abort_request``).
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--max-tokens", type=int, default=1024)
    args = parser.parse_args()

    import torch

    from sglang_patch.dump_writer import DumpWriter

    torch.set_num_threads(1)
    prepared = torch.randn(args.max_tokens, args.slots, args.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    writer = DumpWriter(args.dump_dir)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, status: int, body: dict | None = None) -> None:
            data = json.dumps(body or {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer(200 if self.path in ("/health", "/health_generate") else 404)

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/generate":
                self._answer(200)
                return
            ids = body["input_ids"]
            # The same prepared tensor for every request: the writer takes CPU tensors as they are.
            writer.submit(body["rid"], prepared[: len(ids)], torch.tensor(ids, dtype=torch.int64))
            self._answer(200, {"text": "", "meta_info": {"id": body["rid"], "prompt_tokens": len(ids), "cached_tokens": 0}})

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # socketserver's 5 would refuse connections at concurrency 32
        daemon_threads = True

    server = Server(("127.0.0.1", args.port), Handler)
    print("model-free engine ready", flush=True)
    try:
        server.serve_forever()
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
