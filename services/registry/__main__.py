from muster.services.registry.service import Registry
from muster.shared.service import main

if __name__ == "__main__":
    main(
        "registry",
        Registry.build,
        "Muster registry: publishes each attempt's cluster spec once every endpoint is in.",
    )
