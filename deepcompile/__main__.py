from deepcompile.cli import main

raise SystemExit(main())
