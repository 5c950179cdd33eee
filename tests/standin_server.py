"""The source of a stand-in for an sglang server in tests that start processes without sglang: it
answers `GET /health` on `--host`/`--port` and first runs `worker` (Python source), e.g. a worker it
starts in its process group as sglang starts its scheduler."""

from __future__ import annotations


def standin_source(worker: str) -> str:
    return f"""
import argparse, http.server, subprocess, sys
parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
{worker}

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer((args.host, args.port), Health).serve_forever()
"""
