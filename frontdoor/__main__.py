from batchstring.frontdoor.main import main

main()
