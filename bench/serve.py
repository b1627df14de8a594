"""`python -m bench.serve MODULE:FACTORY PORT`: a torchyard app served on 127.0.0.1:PORT the way
`torchyard serve` serves one (service.serving.serve), so that a bench measures what users run."""

from __future__ import annotations

import importlib
import sys

from service.config import Settings
from service.serving import serve


def main() -> None:
    module_app, port = sys.argv[1:]
    module, factory = module_app.split(":")
    app = getattr(importlib.import_module(module), factory)()
    serve(app, Settings(), host="127.0.0.1", port=int(port), log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
