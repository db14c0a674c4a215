"""`python -m muster.services.portal`: the web portal for a deployment (compose), serving on
MUSTER_PORTAL_HOST:MUSTER_PORTAL_PORT (default 0.0.0.0:8480), signing people in with the login
secrets sealed in MUSTER_AUTH_DIR (default /auth), on the NATS at MUSTER_NATS_URL.
MUSTER_PORTAL_SECURE_COOKIE=1 marks the session cookie Secure (behind an HTTPS proxy)."""

from muster.services.portal.service import main

if __name__ == "__main__":
    main()
