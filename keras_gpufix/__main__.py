from keras_gpufix.cli import main

raise SystemExit(main())
