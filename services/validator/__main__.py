from muster.services.validator.service import Validator
from muster.shared.service import main

if __name__ == "__main__":
    main("validator", Validator.build, "Muster validator: checks job submissions and records accepted jobs.")
