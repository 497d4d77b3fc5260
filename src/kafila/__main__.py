from kafila.cli.commands import main

main()
