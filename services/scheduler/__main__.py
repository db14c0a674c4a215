from muster.services.scheduler.service import Scheduler
from muster.shared.service import main

if __name__ == "__main__":
    main(
        "scheduler",
        Scheduler.build,
        "Muster scheduler: places waiting jobs as gangs (one active leader, standbys).",
    )
