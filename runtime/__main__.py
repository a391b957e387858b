"""`python -m runtime generate|info|export-tokenizer` (runtime/cli.py), and
`python -m runtime serve --port P`: one engine shared by many gateways
(runtime/transport/serve.py)."""
import sys

if sys.argv[1:2] == ["serve"]:
    from runtime.transport.serve import main as serve

    sys.exit(serve(sys.argv[2:]))

from runtime.cli import main  # noqa: E402  (after the serve hand-off: it parses other commands)

sys.exit(main())
