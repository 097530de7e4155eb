from localkv.cli import main

main()
