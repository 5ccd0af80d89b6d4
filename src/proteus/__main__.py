from proteus.cli import main

raise SystemExit(main())
