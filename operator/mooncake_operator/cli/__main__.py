"""`python -m mooncake_operator.cli`: the same as the `mooncake-operator` command."""

from mooncake_operator.cli.main import main

raise SystemExit(main())
