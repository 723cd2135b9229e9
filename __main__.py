from dsv4.convert.entry import main

main()
