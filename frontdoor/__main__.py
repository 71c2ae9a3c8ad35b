from frontdoor.main import main

main()
