from services.gateway.service import Gateway
from shared.service import main

if __name__ == "__main__":
    main(
        "gateway",
        Gateway.build,
        "Muster gateway: answers users' questions about their own jobs (request/reply).",
    )
