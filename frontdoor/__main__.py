from batchstring.frontdoor.gateway.main import main

main()
