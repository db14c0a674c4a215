from services.supervisor.service import Supervisor
from shared.service import main

if __name__ == "__main__":
    main(
        "supervisor",
        Supervisor.build,
        "Muster supervisor: follows task states and enforces completion policy.",
    )
