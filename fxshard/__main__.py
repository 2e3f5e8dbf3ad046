from .dump import main

raise SystemExit(main())
