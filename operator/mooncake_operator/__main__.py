from mooncake_operator.cli.main import main

raise SystemExit(main())
