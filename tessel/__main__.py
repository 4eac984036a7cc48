from tessel.cli import main

main()
