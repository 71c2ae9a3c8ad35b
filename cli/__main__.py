from batchstring.cli.main import main

main()
