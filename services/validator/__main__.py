from services.validator.service import Validator
from shared.service import main

if __name__ == "__main__":
    main("validator", Validator.build, "Muster validator: checks job submissions and records accepted jobs.")
