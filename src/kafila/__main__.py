from kafila.cli.app import main

main()
