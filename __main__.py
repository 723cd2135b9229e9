from dsv4.convert.cli import main

main()
