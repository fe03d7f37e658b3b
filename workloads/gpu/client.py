"""The model server's load (server.py): requests at a steady rate, each answer recorded with its
latency, for as long as a stop file is absent.

    python3 client.py --port P --out FILE [--rate 20] [--persistent 2] [--stop FILE]
                      [--max-s 600] [--seed S] [--unix PATH] [--no-unix FILE]

Request i (its prompt is server.request(i, seed)) is due at start + i / rate. Of every four,
two go over long-lived connections (`--persistent` of them, each one request at a time, in
order), one over a new TCP connection, and one over a new connection to the Unix socket
`--unix` (a new TCP connection when none is given, or while the file --no-unix exists: CRIU
cannot dump one half of a Unix stream connection whose other end is outside the job, so a
checkpoint must not find one open); every 50th request also pings the UDP port.
A request whose connection fails (refused, reset, closed) is sent again on a new connection,
every 50 ms, until answered or 120 s have passed: what a client of a server that is briefly away
does; each retry is counted. Latency is from the time the request was due to its answer, so a
request queued behind a stalled one counts the wait.

Writes one JSON line per request to FILE: {"id", "kind", "due", "done", "answer", "retries"}
(times in seconds of the wall clock; "answer" null if it never came), then a summary line
{"summary": {...}}. Stops sending when --stop exists (or after --max-s), then waits for the
answers still due.
"""
import argparse, json, os, queue, socket, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server import request  # noqa: E402

RETRY_FOR_S = 120.0


class Conn:
    """A line connection that reconnects on failure."""

    def __init__(self, connect):
        self.connect = connect
        self.sock = None
        self.rfile = None

    def ask(self, line):
        """Sends `line`, returns (answer line, retries)."""
        retries, deadline = 0, time.time() + RETRY_FOR_S
        while True:
            try:
                if self.sock is None:
                    self.sock = self.connect()
                    self.rfile = self.sock.makefile("rb")
                self.sock.sendall(line.encode() + b"\n")
                got = self.rfile.readline()
                if not got:
                    raise ConnectionError("closed by the server")
                return got.decode().strip(), retries
            except OSError:
                self.close()
                if time.time() > deadline:
                    return None, retries
                retries += 1
                time.sleep(0.05)

    def close(self):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = self.rfile = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--unix")
    ap.add_argument("--no-unix")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--persistent", type=int, default=2)
    ap.add_argument("--stop")
    ap.add_argument("--max-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    def tcp():
        return socket.create_connection((a.host, a.port), timeout=RETRY_FOR_S)

    def unix():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(RETRY_FOR_S)
        s.connect(a.unix)
        return s

    records, lock = [], threading.Lock()

    def record(i, kind, due, answer, retries):
        with lock:
            records.append({"id": i, "kind": kind, "due": due, "done": time.time(),
                            "answer": answer, "retries": retries})

    def line_of(i):
        return f"{i} {','.join(map(str, request(i, a.seed)))}"

    def answer_of(i, got):
        if got is None or not got.startswith(f"{i} "):
            return None if got is None else f"WRONG-ID {got}"
        return got.split(" ", 1)[1]

    queues = [queue.Queue() for _ in range(a.persistent)]

    def persistent(q):
        c = Conn(tcp)
        while True:
            item = q.get()
            if item is None:
                return
            i, due = item
            got, retries = c.ask(line_of(i))
            record(i, "persistent", due, answer_of(i, got), retries)

    def fresh(i, due, kind):
        c = Conn(unix if kind == "unix" else tcp)
        got, retries = c.ask(line_of(i))
        c.close()
        record(i, kind, due, answer_of(i, got), retries)

    def ping(i, due):
        deadline, retries = time.time() + RETRY_FOR_S, 0
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.settimeout(0.5)
        got = None
        while time.time() < deadline:
            try:
                u.sendto(b"ping\n", (a.host, a.port))
                got = u.recv(64).decode().strip()
                break
            except OSError:
                retries += 1
        u.close()
        record(f"udp{i}", "udp", due, got, retries)

    workers = [threading.Thread(target=persistent, args=(q,), daemon=True) for q in queues]
    for w in workers:
        w.start()
    others = []
    start = time.time()
    i = 0
    while time.time() - start < a.max_s and not (a.stop and os.path.exists(a.stop)):
        due = start + i / a.rate
        now = time.time()
        if due > now:
            time.sleep(due - now)
        slot = i % 4
        if slot < 2 and queues:
            queues[(i // 4 + slot) % len(queues)].put((i, due))
        else:
            unix_ok = a.unix and not (a.no_unix and os.path.exists(a.no_unix))
            kind = "unix" if slot == 3 and unix_ok else "tcp"
            t = threading.Thread(target=fresh, args=(i, due, kind), daemon=True)
            t.start()
            others.append(t)
        if i % 50 == 0:
            t = threading.Thread(target=ping, args=(i, due), daemon=True)
            t.start()
            others.append(t)
        i += 1
    sent = i
    for q in queues:
        q.put(None)
    for t in workers + others:
        t.join(RETRY_FOR_S + 10)
    with lock:
        recs = sorted(records, key=lambda r: r["due"])
    with open(a.out, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
        lat = [r["done"] - r["due"] for r in recs if r["answer"] is not None]
        f.write(json.dumps({"summary": {
            "sent": sent, "answered": sum(1 for r in recs if r["answer"] is not None and r["kind"] != "udp"),
            "pings": sum(1 for r in recs if r["kind"] == "udp"),
            "retries": sum(r["retries"] for r in recs),
            "max_latency_s": max(lat) if lat else None}}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
