from ringsplash.evals.cli import main

main()
