from tessel.commands.cli import main

main()
