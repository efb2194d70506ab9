from aici_cli.cli import main

main()
