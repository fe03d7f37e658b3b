"""A model server: a small transformer language model (random weights from a fixed seed, nothing
downloaded) answering generation requests over TCP, for checkpoint, restore and migration checks
of a job with sockets.

    python3 server.py [--port P] [--port-file FILE] [--host 127.0.0.1] [--new-tokens 4]
                      [--device cuda|cpu]
    python3 server.py --reference N [--seed S]        the answers to requests 0..N-1, one a line

The protocol, one line each way: the client sends `ID T1,T2,...` (a request id and the prompt's
token ids), the server answers `ID A1,A2,...`: the --new-tokens tokens that greedy decoding adds
to the prompt. An answer depends on nothing but the prompt (no state is kept between requests,
the algorithms are deterministic), so every answer can be checked against --reference's, which
runs the same model in one process without a socket (run it without possum: a bare server's
answers). `request(i, seed)` gives request i's prompt, as client.py sends it.

Connections are served by threads; the model runs one request at a time. Also listens on a UDP
port (the TCP port's number) that answers `ping` with `pong`, and on a Unix socket
(`FILE.sock` beside --port-file), same protocol as TCP, so that the job holds every kind of
listening socket. Once listening it writes the TCP port to --port-file (written whole, then
renamed) and prints `listening PORT`.
"""
import argparse, os, random, socket, socketserver, sys, threading, time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

VOCAB, CTX = 4096, 128


def request(i, seed=0):
    """Request i's prompt: 4 to 16 token ids."""
    r = random.Random(seed * 1_000_003 + i)
    return [r.randrange(VOCAB) for _ in range(r.randint(4, 16))]


class Model:
    """A small causal transformer language model (2 layers, 256 wide, 4 heads; random weights
    from seed 0) in plain torch operations, decoding greedily."""

    def __init__(self, new_tokens, device="cuda"):
        import torch

        torch.manual_seed(0)
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        nn = torch.nn
        self.torch, self.device, self.width, self.heads = torch, device, 256, 4
        w = self.width
        self.embed = nn.Embedding(VOCAB, w)
        self.pos = nn.Embedding(CTX, w)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"ln1": nn.LayerNorm(w), "qkv": nn.Linear(w, 3 * w), "proj": nn.Linear(w, w),
                           "ln2": nn.LayerNorm(w), "up": nn.Linear(w, 4 * w), "down": nn.Linear(4 * w, w)})
            for _ in range(2))
        self.ln = nn.LayerNorm(w)
        self.head = nn.Linear(w, VOCAB)
        for m in (self.embed, self.pos, self.layers, self.ln, self.head):
            m.to(device).eval()
        self.new_tokens = new_tokens
        self.lock = threading.Lock()
        self.served, self.busy_s = 0, 0.0

    def logits(self, ids):
        """The next token's logits after `ids` (1 x n)."""
        torch = self.torch
        n, w, h = ids.shape[1], self.width, self.heads
        x = self.embed(ids) + self.pos(torch.arange(n, device=self.device))
        causal = torch.full((n, n), float("-inf"), device=self.device).triu(1)
        for l in self.layers:
            q, k, v = l["qkv"](l["ln1"](x)).split(w, dim=-1)
            q, k, v = (t.view(1, n, h, w // h).transpose(1, 2) for t in (q, k, v))
            att = torch.softmax(q @ k.transpose(-1, -2) / (w // h) ** 0.5 + causal, dim=-1)
            x = x + l["proj"]((att @ v).transpose(1, 2).reshape(1, n, w))
            x = x + l["down"](torch.nn.functional.gelu(l["up"](l["ln2"](x))))
        return self.head(self.ln(x[:, -1]))

    def answer(self, prompt):
        torch = self.torch
        with self.lock, torch.inference_mode():
            t = time.perf_counter()
            ids = torch.tensor([prompt], device=self.device)
            out = []
            for _ in range(self.new_tokens):
                nxt = int(self.logits(ids)[0].argmax())
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]], device=self.device)], dim=1)
            self.served += 1
            self.busy_s += time.perf_counter() - t
            if self.served % 200 == 0:
                print(f"served {self.served}, {1000 * self.busy_s / self.served:.1f} ms each on average",
                      file=sys.stderr, flush=True)
            return out


def parse(line):
    """`ID T1,T2,...` -> (id, prompt); None for a malformed line."""
    try:
        rid, toks = line.split(" ", 1)
        prompt = [int(t) for t in toks.split(",")]
    except ValueError:
        return None
    if not prompt or len(prompt) > CTX // 2 or any(t < 0 or t >= VOCAB for t in prompt):
        return None
    return rid, prompt


def serve_lines(model, rfile, wfile):
    for raw in rfile:
        req = parse(raw.decode(errors="replace").strip())
        if req is None:
            wfile.write(b"error bad request\n")
        else:
            rid, prompt = req
            wfile.write(f"{rid} {','.join(map(str, model.answer(prompt)))}\n".encode())
        wfile.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--reference", type=int, help="print the answers to requests 0..N-1 and exit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="where the model runs (cpu: a check without a GPU)")
    a = ap.parse_args()
    model = Model(a.new_tokens, a.device)
    if a.reference is not None:
        for i in range(a.reference):
            print(f"{i} {','.join(map(str, model.answer(request(i, a.seed))))}")
        return

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            try:
                serve_lines(model, self.rfile, self.wfile)
            except OSError:
                pass

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    class UnixServer(socketserver.ThreadingUnixStreamServer):
        daemon_threads = True

    tcp = Server((a.host, a.port), Handler)
    port = tcp.server_address[1]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((a.host, port))

    def pong():
        while True:
            data, peer = udp.recvfrom(64)
            if data.strip() == b"ping":
                udp.sendto(b"pong\n", peer)

    threading.Thread(target=pong, daemon=True).start()
    if a.port_file:
        path = a.port_file + ".sock"
        if os.path.exists(path):
            os.unlink(path)
        unix = UnixServer(path, Handler)
        threading.Thread(target=unix.serve_forever, daemon=True).start()
        with open(a.port_file + ".tmp", "w") as f:
            f.write(f"{port}\n")
        os.rename(a.port_file + ".tmp", a.port_file)
    print(f"listening {port}", flush=True)
    tcp.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
