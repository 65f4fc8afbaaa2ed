from dcptool.cli import main

main()
