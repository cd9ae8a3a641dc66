from mooncake_operator.cli import main

raise SystemExit(main())
