"""Run inside a sandbox by the Credential Vault tests (tests/sdk/test_credential_vault.py and
crates/fastbox-cli/tests/egress_e2e/vault.rs): an HTTPS request to argv[1] (at address
argv[2] when given, the name still sent as SNI and Host) with a placeholder credential of
the sandbox's own. It trusts the system store, and the file $LAB_CA too when set. Prints
`STATUS ECHO | BODY`, or `error TYPE MESSAGE`.
"""

import http.client, os, socket, ssl, sys
host = sys.argv[1]
ctx = ssl.create_default_context()
if os.environ.get("LAB_CA"):
    ctx.load_verify_locations(os.environ["LAB_CA"])
try:
    conn = http.client.HTTPSConnection(host, 443, context=ctx, timeout=15)
    if len(sys.argv) > 2:
        raw = socket.create_connection((sys.argv[2], 443), timeout=15)
        conn.sock = ctx.wrap_socket(raw, server_hostname=host)
    conn.request("GET", "/user/repos?per_page=1",
                 headers={"Authorization": "Bearer sandbox-placeholder"})
    r = conn.getresponse()
    print(r.status, r.getheader("x-echo"), "|", r.read().decode(), flush=True)
except Exception as e:
    print("error", type(e).__name__, e, flush=True)
