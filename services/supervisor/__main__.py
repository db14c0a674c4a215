from muster.services.supervisor.service import Supervisor
from muster.shared.service import main

if __name__ == "__main__":
    main(
        "supervisor",
        Supervisor.build,
        "Muster supervisor: follows task states and enforces completion policy.",
    )
