from muster.services.gateway.service import Gateway
from muster.shared.service import main

if __name__ == "__main__":
    main(
        "gateway",
        Gateway.build,
        "Muster gateway: answers users' questions about their own jobs (request/reply).",
    )
