#!/usr/bin/env python3
"""A fencelock sidecar client in plain Python (standard library only).

It acquires a lock through `fencelock serve`, waiting while another application holds it;
keeps the lease alive with keep-alives from a thread of its own, every third of the TTL (a
process that is stopped or has crashed sends none, so its lease ends within one TTL); holds
the lease's event stream open in another thread, to learn at once of a loss; does its work in
steps, sending the fencing token with every write (here to the sidecar's fence endpoint,
standing in for the protected resource); stops the moment the stream reports `lost` or a
keep-alive is refused; and releases.

    python3 client.py --sidecar http://127.0.0.1:7878 --resource nightly-invoices --steps 10

Exit status: 0 done and released, 3 the lease was lost (work stopped), 4 a write was refused
as stale, 75 the lock stayed held for the whole wait.
"""

import argparse
import json
import os
import sys
import threading
import urllib.error
import urllib.request


class Sidecar:
    def __init__(self, base, token=None, timeout=30):
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _request(self, method, path, body=None, timeout=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        return urllib.request.urlopen(req, timeout=timeout or self.timeout)

    def call(self, method, path, body=None, timeout=None):
        """Returns (status, JSON answer), whatever the status."""
        try:
            with self._request(method, path, body, timeout) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def acquire(self, resource, ttl_ms, wait_ms):
        # The server waits up to wait_ms; give the HTTP call that long and then some.
        return self.call("POST", "/v1/acquire",
                         {"resource": resource, "ttl_ms": ttl_ms, "wait_ms": wait_ms},
                         timeout=wait_ms / 1000 + self.timeout)

    def events(self, lease_id):
        """Yields (event, data) from the lease's Server-Sent Events until the stream ends.

        The connection is closed as soon as the caller stops reading (after `lost`): closing it
        is how the sidecar learns that the application heard the news (see its shutdown)."""
        # No read timeout: the server sends a heartbeat well within the TTL.
        with self._request("GET", "/v1/leases/%s/events" % lease_id, timeout=None) as resp:
            name = None
            for raw in resp:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    yield name, json.loads(line[len("data: "):])
                    name = None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sidecar", default="http://127.0.0.1:7878")
    p.add_argument("--resource", required=True)
    p.add_argument("--ttl-ms", type=int, default=10000)
    p.add_argument("--wait-ms", type=int, default=30000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-seconds", type=float, default=0.2)
    args = p.parse_args()
    sidecar = Sidecar(args.sidecar, os.environ.get("FENCELOCK_SIDECAR_TOKEN"))

    status, lease = sidecar.acquire(args.resource, args.ttl_ms, args.wait_ms)
    if status != 200:
        print("not acquired: %s" % lease.get("message"), flush=True)
        return 75 if lease.get("error") in ("held", "timed_out") else 1
    token, lease_id = lease["token"], lease["lease_id"]
    print("granted %s token %d" % (args.resource, token), flush=True)

    lost = threading.Event()
    streaming = threading.Event()
    stream_done = threading.Event()
    why = {}

    def watch():
        try:
            for event, data in sidecar.events(lease_id):
                if event == "granted":
                    streaming.set()
                elif event == "lost":
                    # The stream's reason is the precise one: it wins over a refused keep-alive.
                    why["reason"] = data.get("reason")
                    break
        except OSError as e:
            why.setdefault("reason", "stream failed: %s" % e)
        finally:
            # A stream that ends for any reason means the lease can no longer be relied on.
            streaming.set()
            lost.set()
            stream_done.set()

    def keep_alive():
        # The lease's sign of life: it must come from this process, so that a process that is
        # stopped (SIGSTOP, a debugger) or hung loses its lease within one TTL. An open stream
        # is not one: the kernel keeps a stopped process's connection open.
        while not lost.wait(args.ttl_ms / 3000):
            try:
                status, answer = sidecar.call("POST", "/v1/leases/%s/keepalive" % lease_id,
                                              timeout=args.ttl_ms / 3000)
            except OSError as e:
                status, answer = None, {"message": str(e)}
            if status != 200:
                why.setdefault("reason", "keep-alive refused: %s" % answer.get("message"))
                lost.set()

    threading.Thread(target=watch, daemon=True).start()
    threading.Thread(target=keep_alive, daemon=True).start()
    streaming.wait(10)

    for step in range(args.steps):
        if lost.is_set():
            break
        # The write carries the token; the fence refuses it if a newer holder has written.
        status, answer = sidecar.call("POST", "/v1/fence",
                                      {"resource": args.resource, "token": token})
        if status == 409:
            print("write %d refused: token %d is stale, highest %d"
                  % (step, token, answer["highest"]), flush=True)
            return 4
        print("write %d accepted with token %d" % (step, token), flush=True)
        if lost.wait(args.step_seconds):
            break

    if lost.is_set():
        # The work has stopped; the stream, if it is still open, says why within a moment.
        stream_done.wait(1)
        print("lost: %s; stopped the work" % why.get("reason"), flush=True)
        return 3
    status, answer = sidecar.call("POST", "/v1/leases/%s/release" % lease_id)
    print("released" if status == 200 else "release failed: %s" % answer.get("message"), flush=True)
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
