from ma_runtime.cli import entry_main

entry_main()
