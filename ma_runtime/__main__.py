from ma_runtime.cli import main

raise SystemExit(main())
