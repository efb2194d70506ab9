from aici_cli.cli.main import main

main()
