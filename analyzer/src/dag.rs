//! The kernel/buffer DAG: an aggregate bipartite graph of which kernels read and write which
//! buffers, and a bounded window of the last launches as a true dependency DAG.
//!
//! The interposer records launches on its `possum-dag` thread, off the launch path; that thread
//! must keep up with every launch of the job, so [`Dag::record_launch`] costs O(buffers touched)
//! amortized: hash-map look-ups, no graph scans.
//! The window keeps at most `window` launches; per-buffer reader lists are pruned as the window
//! slides, so memory stays bounded by the window, the live buffers, the kernels and the streams.

use std::collections::{HashSet, VecDeque};

// Keys are ids and handles chosen by possum or the driver, not by an adversary: the fast hash.
use rustc_hash::FxHashMap as HashMap;
use std::fmt::Write as _;

use petgraph::graph::{DiGraph, EdgeIndex, NodeIndex};
use petgraph::visit::EdgeRef;
use serde_json::{json, Value};
use smallvec::SmallVec;

/// Handle of the pseudo-kernel standing for copies ([`KernelRef::MEMCPY`]).
pub const MEMCPY_HANDLE: u64 = 0;
/// Handle of the pseudo-kernel standing for memsets ([`KernelRef::MEMSET`]).
pub const MEMSET_HANDLE: u64 = 1;

/// The default number of launches kept in the window.
pub const DEFAULT_WINDOW: usize = 4096;

/// A kernel as the launch path knows it. Real kernel handles are driver pointers, never 0 or 1,
/// which stand for copies and memsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelRef<'a> {
    /// The kernel handle.
    pub handle: u64,
    /// Its (mangled) name, when known; copied on first sight only.
    pub name: Option<&'a str>,
    /// Whether it is opaque (treated as touching every buffer).
    pub opaque: bool,
}

impl KernelRef<'static> {
    /// The pseudo-kernel of copies.
    pub const MEMCPY: Self = Self {
        handle: MEMCPY_HANDLE,
        name: Some("memcpy"),
        opaque: false,
    };
    /// The pseudo-kernel of memsets.
    pub const MEMSET: Self = Self {
        handle: MEMSET_HANDLE,
        name: Some("memset"),
        opaque: false,
    };
}

/// A buffer as the launch path knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufRef {
    /// The buffer id (unique over the job's life).
    pub id: u64,
    /// Its device address.
    pub va: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Whether it is managed (unified) memory.
    pub managed: bool,
}

/// Kind of an aggregate edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EdgeKind {
    /// buffer -> kernel.
    Read,
    /// kernel -> buffer.
    Write,
}

impl EdgeKind {
    fn as_str(self) -> &'static str {
        match self {
            EdgeKind::Read => "read",
            EdgeKind::Write => "write",
        }
    }
}

/// Why one launch of the window depends on an earlier one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DepKind {
    /// It reads a buffer the earlier one wrote last.
    Raw,
    /// It writes a buffer the earlier one read since the last write.
    War,
    /// It writes a buffer the earlier one wrote last.
    Waw,
    /// The earlier one is the previous launch on the same stream.
    Stream,
}

impl DepKind {
    fn as_str(self) -> &'static str {
        match self {
            DepKind::Raw => "raw",
            DepKind::War => "war",
            DepKind::Waw => "waw",
            DepKind::Stream => "stream",
        }
    }
}

#[derive(Debug)]
enum Node {
    Kernel {
        handle: u64,
        name: Option<String>,
        launches: u64,
        opaque: bool,
    },
    Buffer {
        id: u64,
        va: u64,
        size: u64,
        managed: bool,
        freed: bool,
    },
}

impl Node {
    fn to_json(&self) -> Value {
        match self {
            Node::Kernel {
                handle,
                name,
                launches,
                opaque,
            } => json!({"handle": handle, "name": name, "launches": launches, "opaque": opaque}),
            Node::Buffer {
                id,
                va,
                size,
                managed,
                freed,
            } => json!({"id": id, "va": va, "size": size, "managed": managed, "freed": freed}),
        }
    }
}

#[derive(Debug)]
struct Edge {
    kind: EdgeKind,
    count: u64,
}

#[derive(Debug)]
struct Launch {
    seq: u64,
    kernel: u64,
    stream: u64,
    reads: Ids,
    writes: Ids,
    /// (earlier seq, kind), sorted, deduplicated; may name launches that left the window.
    deps: SmallVec<[(u64, DepKind); 6]>,
}

/// A launch's buffer ids: inline for the usual few (no allocation per recorded launch).
type Ids = SmallVec<[u64; 4]>;

#[derive(Debug, Default)]
struct BufState {
    last_writer: Option<u64>,
    /// Launches that read the buffer since its last write, oldest first.
    readers: VecDeque<u64>,
}

/// The aggregate kernel/buffer graph and the window of recent launches.
///
/// Freed buffers keep their node in the aggregate graph, marked `freed` (the history stays), but
/// leave the window's dependency tracking: a later launch does not depend on writers of a freed
/// buffer. A buffer id seen again after its free is live again.
#[derive(Debug)]
pub struct Dag {
    window: usize,
    graph: DiGraph<Node, Edge>,
    kernels: HashMap<u64, NodeIndex>,
    buffers: HashMap<u64, NodeIndex>,
    edges: HashMap<(NodeIndex, NodeIndex), EdgeIndex>,
    launches: VecDeque<Launch>,
    next_seq: u64,
    buf_state: HashMap<u64, BufState>,
    stream_last: HashMap<u64, u64>,
    /// [`Dag::record_launch`]'s scratch list of dependencies.
    deps_scratch: Vec<(u64, DepKind)>,
}

impl Default for Dag {
    fn default() -> Self {
        Self::new(DEFAULT_WINDOW)
    }
}

impl Dag {
    /// An empty DAG keeping the last `window` launches (0: aggregate graph only).
    pub fn new(window: usize) -> Self {
        Self {
            window,
            graph: DiGraph::new(),
            kernels: HashMap::default(),
            buffers: HashMap::default(),
            edges: HashMap::default(),
            launches: VecDeque::new(),
            next_seq: 0,
            buf_state: HashMap::default(),
            stream_last: HashMap::default(),
            deps_scratch: Vec::new(),
        }
    }

    fn kernel_node(&mut self, k: &KernelRef<'_>) -> NodeIndex {
        if let Some(&n) = self.kernels.get(&k.handle) {
            if let Node::Kernel { name, opaque, .. } = &mut self.graph[n] {
                *opaque |= k.opaque;
                if name.is_none() {
                    *name = k.name.map(str::to_string);
                }
            }
            return n;
        }
        let n = self.graph.add_node(Node::Kernel {
            handle: k.handle,
            name: k.name.map(str::to_string),
            launches: 0,
            opaque: k.opaque,
        });
        self.kernels.insert(k.handle, n);
        n
    }

    fn buffer_node(&mut self, b: &BufRef) -> NodeIndex {
        if let Some(&n) = self.buffers.get(&b.id) {
            if let Node::Buffer {
                va,
                size,
                managed,
                freed,
                ..
            } = &mut self.graph[n]
            {
                (*va, *size, *managed, *freed) = (b.va, b.size, b.managed, false);
            }
            return n;
        }
        let n = self.graph.add_node(Node::Buffer {
            id: b.id,
            va: b.va,
            size: b.size,
            managed: b.managed,
            freed: false,
        });
        self.buffers.insert(b.id, n);
        n
    }

    fn bump_edge(&mut self, from: NodeIndex, to: NodeIndex, kind: EdgeKind) {
        match self.edges.get(&(from, to)) {
            Some(&e) => self.graph[e].count += 1,
            None => {
                let e = self.graph.add_edge(from, to, Edge { kind, count: 1 });
                self.edges.insert((from, to), e);
            }
        }
    }

    /// Records one launch of `kernel` on `stream` reading `reads` and writing `writes`.
    /// A buffer both read and written appears in both lists.
    pub fn record_launch(
        &mut self,
        kernel: &KernelRef<'_>,
        stream: u64,
        reads: &[BufRef],
        writes: &[BufRef],
    ) {
        let k = self.kernel_node(kernel);
        if let Node::Kernel { launches, .. } = &mut self.graph[k] {
            *launches += 1;
        }
        for b in reads {
            let n = self.buffer_node(b);
            self.bump_edge(n, k, EdgeKind::Read);
        }
        for b in writes {
            let n = self.buffer_node(b);
            self.bump_edge(k, n, EdgeKind::Write);
        }

        let seq = self.next_seq;
        self.next_seq += 1;
        if self.window == 0 {
            return;
        }
        while self.launches.len() >= self.window {
            self.launches.pop_front();
        }
        let oldest = self.launches.front().map_or(seq, |l| l.seq);

        // Gathered in a buffer kept across launches (no allocation once it has grown).
        let mut deps = std::mem::take(&mut self.deps_scratch);
        deps.clear();
        if let Some(prev) = self.stream_last.insert(stream, seq) {
            if prev >= oldest {
                deps.push((prev, DepKind::Stream));
            }
        }
        for b in reads {
            if let Some(st) = self.buf_state.get(&b.id) {
                if let Some(w) = st.last_writer.filter(|&w| w >= oldest) {
                    deps.push((w, DepKind::Raw));
                }
            }
        }
        for b in writes {
            if let Some(st) = self.buf_state.get(&b.id) {
                if let Some(w) = st.last_writer.filter(|&w| w >= oldest) {
                    deps.push((w, DepKind::Waw));
                }
                deps.extend(
                    st.readers
                        .iter()
                        .filter(|&&r| r >= oldest)
                        .map(|&r| (r, DepKind::War)),
                );
            }
        }
        deps.sort_unstable();
        deps.dedup();
        let launch_deps = SmallVec::from_slice(&deps);
        self.deps_scratch = deps;

        for b in reads {
            let st = self.buf_state.entry(b.id).or_default();
            while st.readers.front().is_some_and(|&r| r < oldest) {
                st.readers.pop_front();
            }
            if st.readers.back() != Some(&seq) {
                st.readers.push_back(seq);
            }
        }
        for b in writes {
            let st = self.buf_state.entry(b.id).or_default();
            st.last_writer = Some(seq);
            st.readers.clear();
        }
        self.launches.push_back(Launch {
            seq,
            kernel: kernel.handle,
            stream,
            reads: reads.iter().map(|b| b.id).collect(),
            writes: writes.iter().map(|b| b.id).collect(),
            deps: launch_deps,
        });
    }

    /// Records that launches went unrecorded since the last one (the job was sampled): the
    /// window starts afresh, so no dependency spans the gap (the writer before it may not be
    /// the last one). The aggregate graph keeps everything.
    pub fn record_gap(&mut self) {
        self.launches.clear();
        self.buf_state.clear();
        self.stream_last.clear();
    }

    /// Records that buffer `id` was freed: its node stays, marked freed, and it leaves the
    /// window's dependency tracking. Unknown ids are ignored.
    pub fn record_free(&mut self, id: u64) {
        if let Some(&n) = self.buffers.get(&id) {
            if let Node::Buffer { freed, .. } = &mut self.graph[n] {
                *freed = true;
            }
        }
        self.buf_state.remove(&id);
    }

    /// Marks kernel `handle` opaque (no effect on a kernel never recorded).
    pub fn set_kernel_opaque(&mut self, handle: u64) {
        if let Some(&n) = self.kernels.get(&handle) {
            if let Node::Kernel { opaque, .. } = &mut self.graph[n] {
                *opaque = true;
            }
        }
    }

    /// Whether kernel `handle` has been recorded (then a launch of it needs neither its name nor
    /// its opaqueness: [`Dag::set_kernel_opaque`] keeps the latter).
    pub fn knows_kernel(&self, handle: u64) -> bool {
        self.kernels.contains_key(&handle)
    }

    /// Launches in the window now.
    pub fn window_len(&self) -> usize {
        self.launches.len()
    }

    /// Kernels recorded (pseudo-kernels included).
    pub fn kernel_count(&self) -> usize {
        self.kernels.len()
    }

    /// Buffers recorded (freed ones included).
    pub fn buffer_count(&self) -> usize {
        self.buffers.len()
    }

    /// Buffer ids in order of first use in the window (a launch's reads before its writes): the
    /// prefetch order for a restore.
    pub fn buffer_first_use(&self) -> Vec<u64> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for l in &self.launches {
            for &id in l.reads.iter().chain(&l.writes) {
                if seen.insert(id) {
                    out.push(id);
                }
            }
        }
        out
    }

    /// Buffer ids in the order the job is predicted to write them next, soonest first. A training
    /// loop repeats its launches: what followed the latest launch's previous occurrence in the
    /// window (the same kernel writing the same buffers) is what comes next, so the writes of the
    /// launches after that occurrence come first, in order, then those of the launches before
    /// it. Without an earlier occurrence, the window's writes oldest first. Each id once.
    pub fn predicted_writes(&self) -> Vec<u64> {
        let Some(last) = self.launches.back() else {
            return Vec::new();
        };
        let n = self.launches.len();
        let start = self
            .launches
            .iter()
            .take(n - 1)
            .rposition(|l| l.kernel == last.kernel && l.writes == last.writes)
            .map_or(0, |p| p + 1);
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        let after = self.launches.iter().skip(start);
        for l in after.chain(self.launches.iter().take(start)) {
            for &id in &l.writes {
                if seen.insert(id) {
                    out.push(id);
                }
            }
        }
        out
    }

    fn oldest(&self) -> u64 {
        self.launches.front().map_or(self.next_seq, |l| l.seq)
    }

    /// The window's dependencies as `(from seq, to seq, kind)`, launches that left the window
    /// left out.
    fn window_deps(&self) -> impl Iterator<Item = (u64, u64, DepKind)> + '_ {
        let oldest = self.oldest();
        self.launches.iter().flat_map(move |l| {
            l.deps
                .iter()
                .filter(move |d| d.0 >= oldest)
                .map(move |&(f, k)| (f, l.seq, k))
        })
    }

    fn sorted_nodes(&self) -> (Vec<&Node>, Vec<&Node>) {
        let mut ks: Vec<&Node> = self.kernels.values().map(|&n| &self.graph[n]).collect();
        let mut bs: Vec<&Node> = self.buffers.values().map(|&n| &self.graph[n]).collect();
        let key = |n: &&Node| match n {
            Node::Kernel { handle, .. } => *handle,
            Node::Buffer { id, .. } => *id,
        };
        ks.sort_by_key(key);
        bs.sort_by_key(key);
        (ks, bs)
    }

    /// Both views as JSON: `{"kernels": [...], "buffers": [...], "edges": [{"kernel", "buffer",
    /// "kind", "count"}], "window": {"launches": [...], "deps": [[from, to, kind], ...]}}`.
    pub fn to_json(&self) -> Value {
        let (ks, bs) = self.sorted_nodes();
        let kernels: Vec<Value> = ks.into_iter().map(Node::to_json).collect();
        let buffers: Vec<Value> = bs.into_iter().map(Node::to_json).collect();
        let mut edges: Vec<(u64, u64, EdgeKind, u64)> = self
            .graph
            .edge_references()
            .filter_map(|e| {
                let w = e.weight();
                let (k, buf) = if w.kind == EdgeKind::Read {
                    (e.target(), e.source())
                } else {
                    (e.source(), e.target())
                };
                match (&self.graph[k], &self.graph[buf]) {
                    (Node::Kernel { handle, .. }, Node::Buffer { id, .. }) => {
                        Some((*handle, *id, w.kind, w.count))
                    }
                    _ => None,
                }
            })
            .collect();
        edges.sort_by_key(|&(k, b, kind, _)| (k, b, kind == EdgeKind::Write));
        let edges: Vec<Value> = edges
            .into_iter()
            .map(|(k, b, kind, count)| json!({"kernel": k, "buffer": b, "kind": kind.as_str(), "count": count}))
            .collect();
        let launches: Vec<Value> = self
            .launches
            .iter()
            .map(|l| json!({"seq": l.seq, "kernel": l.kernel, "stream": l.stream, "reads": l.reads.as_slice(), "writes": l.writes.as_slice()}))
            .collect();
        let deps: Vec<Value> = self
            .window_deps()
            .map(|(f, t, k)| json!([f, t, k.as_str()]))
            .collect();
        json!({
            "kernels": kernels,
            "buffers": buffers,
            "edges": edges,
            "window": {"launches": launches, "deps": deps},
        })
    }

    /// The aggregate graph in Graphviz DOT: kernels as boxes (opaque ones filled), buffers as
    /// ellipses labelled with their size (freed ones dotted), read edges dashed.
    pub fn to_dot(&self) -> String {
        let (ks, bs) = self.sorted_nodes();
        let mut s = String::from("digraph possum {\n  rankdir=LR;\n");
        for n in ks {
            if let Node::Kernel {
                handle,
                name,
                launches,
                opaque,
            } = n
            {
                let label = name.clone().unwrap_or_else(|| format!("{handle:#x}"));
                let style = if *opaque {
                    ",style=filled,fillcolor=\"#f4cccc\""
                } else {
                    ""
                };
                let note = if *opaque { " (opaque)" } else { "" };
                let _ = writeln!(
                    s,
                    "  k{handle} [shape=box{style},label=\"{}\\n{launches} launches{note}\"];",
                    dot_escape(&label)
                );
            }
        }
        for n in bs {
            if let Node::Buffer {
                id,
                size,
                managed,
                freed,
                ..
            } = n
            {
                let style = if *freed { ",style=dotted" } else { "" };
                let m = if *managed { " managed" } else { "" };
                let _ = writeln!(
                    s,
                    "  b{id} [shape=ellipse{style},label=\"buffer {id}{m}\\n{}\"];",
                    human_size(*size)
                );
            }
        }
        for e in self.graph.edge_references() {
            let w = e.weight();
            let id = |n: NodeIndex| match &self.graph[n] {
                Node::Kernel { handle, .. } => format!("k{handle}"),
                Node::Buffer { id, .. } => format!("b{id}"),
            };
            let style = if w.kind == EdgeKind::Read {
                "style=dashed,"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "  {} -> {} [{style}label=\"{}\"];",
                id(e.source()),
                id(e.target()),
                w.count
            );
        }
        s.push_str("}\n");
        s
    }

    /// Whether the window's launches and dependencies form a DAG (they always should: every
    /// dependency points to an earlier launch).
    pub fn is_acyclic_window(&self) -> bool {
        let mut g: DiGraph<u64, DepKind> = DiGraph::with_capacity(self.launches.len(), 0);
        let mut index = HashMap::with_capacity_and_hasher(self.launches.len(), Default::default());
        for l in &self.launches {
            index.insert(l.seq, g.add_node(l.seq));
        }
        for (f, t, k) in self.window_deps() {
            if let (Some(&a), Some(&b)) = (index.get(&f), index.get(&t)) {
                g.add_edge(a, b, k);
            }
        }
        !petgraph::algo::is_cyclic_directed(&g)
    }
}

/// Escapes a string for a double-quoted DOT label.
fn dot_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => {}
            c => out.push(c),
        }
    }
    out
}

fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn buf(id: u64) -> BufRef {
        BufRef {
            id,
            va: 0x1000 * (id + 1),
            size: 4096 << id,
            managed: id == 3,
        }
    }

    fn k(handle: u64, name: &str) -> KernelRef<'_> {
        KernelRef {
            handle,
            name: Some(name),
            opaque: false,
        }
    }

    fn deps(d: &Dag) -> Vec<(u64, u64, DepKind)> {
        d.window_deps().collect()
    }

    #[test]
    fn aggregate_graph_counts_and_json() {
        let mut d = Dag::new(16);
        d.record_launch(&KernelRef::MEMCPY, 1, &[], &[buf(0)]);
        d.record_launch(&k(0x5000, "gemm"), 1, &[buf(0), buf(1)], &[buf(2)]);
        d.record_launch(&k(0x5000, "gemm"), 1, &[buf(0), buf(1)], &[buf(2)]);
        d.set_kernel_opaque(0x5000);
        d.record_free(1);
        let j = d.to_json();
        assert_eq!(j["kernels"].as_array().unwrap().len(), 2);
        assert_eq!(
            j["kernels"][0],
            json!({"handle": 0, "name": "memcpy", "launches": 1, "opaque": false})
        );
        assert_eq!(
            j["kernels"][1],
            json!({"handle": 0x5000, "name": "gemm", "launches": 2, "opaque": true})
        );
        assert_eq!(
            j["buffers"][1],
            json!({"id": 1, "va": 0x2000, "size": 8192, "managed": false, "freed": true})
        );
        assert_eq!(
            j["edges"],
            json!([
                {"kernel": 0, "buffer": 0, "kind": "write", "count": 1},
                {"kernel": 0x5000, "buffer": 0, "kind": "read", "count": 2},
                {"kernel": 0x5000, "buffer": 1, "kind": "read", "count": 2},
                {"kernel": 0x5000, "buffer": 2, "kind": "write", "count": 2},
            ])
        );
        assert_eq!(j["window"]["launches"].as_array().unwrap().len(), 3);
        assert_eq!(j["window"]["launches"][1]["reads"], json!([0, 1]));
        assert_eq!(
            j["window"]["deps"],
            json!([
                [0, 1, "raw"],
                [0, 1, "stream"],
                [0, 2, "raw"],
                [1, 2, "waw"],
                [1, 2, "stream"]
            ])
        );
        assert_eq!(d.kernel_count(), 2);
        assert_eq!(d.buffer_count(), 3);
    }

    #[test]
    fn dependencies_across_streams() {
        let mut d = Dag::new(16);
        d.record_launch(&k(10, "w"), 1, &[], &[buf(0)]); // 0
        d.record_launch(&k(11, "r"), 2, &[buf(0)], &[]); // 1: RAW on 0
        d.record_launch(&k(11, "r"), 3, &[buf(0)], &[]); // 2: RAW on 0
        d.record_launch(&k(10, "w"), 4, &[buf(0)], &[buf(0)]); // 3: RAW+WAW on 0, WAR on 1, 2
        d.record_launch(&k(11, "r"), 2, &[buf(0)], &[]); // 4: RAW on 3, stream after 1
        assert_eq!(
            deps(&d),
            vec![
                (0, 1, DepKind::Raw),
                (0, 2, DepKind::Raw),
                (0, 3, DepKind::Raw),
                (0, 3, DepKind::Waw),
                (1, 3, DepKind::War),
                (2, 3, DepKind::War),
                (1, 4, DepKind::Stream),
                (3, 4, DepKind::Raw),
            ]
        );
        assert!(d.is_acyclic_window());
    }

    #[test]
    fn freed_buffers_leave_dependency_tracking() {
        let mut d = Dag::new(16);
        d.record_launch(&k(10, "w"), 1, &[], &[buf(0)]);
        d.record_free(0);
        d.record_launch(&k(11, "r"), 2, &[buf(0)], &[]);
        assert!(deps(&d).is_empty());
        assert_eq!(
            d.to_json()["buffers"][0]["freed"],
            false,
            "seen again: live"
        );
    }

    #[test]
    fn no_dependency_spans_a_gap() {
        let mut d = Dag::new(16);
        let (b0, b1) = (buf(0), buf(1));
        d.record_launch(&k(1, "w"), 7, &[], &[b0]);
        d.record_launch(&k(2, "r"), 7, &[b0], &[b1]);
        assert_eq!(
            deps(&d),
            vec![(0, 1, DepKind::Raw), (0, 1, DepKind::Stream)]
        );
        d.record_gap();
        d.record_launch(&k(2, "r"), 7, &[b0], &[b1]);
        assert_eq!(d.window_len(), 1);
        assert!(deps(&d).is_empty(), "{:?}", deps(&d));
        // The aggregate graph keeps every launch.
        let j = d.to_json();
        let r = j["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == "r")
            .unwrap();
        assert_eq!(r["launches"], 2);
    }

    #[test]
    fn the_writes_after_the_last_launchs_previous_occurrence_are_predicted_first() {
        let mut d = Dag::new(64);
        assert!(d.predicted_writes().is_empty());
        // A step: forward writes 1 then 2, backward writes 3, the optimizer 4 then 1 again.
        let step = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 1)];
        for (kernel, w) in step {
            d.record_launch(&k(kernel, "k"), 7, &[], &[buf(w)]);
        }
        // No earlier occurrence of the last launch: the window's writes, oldest first.
        assert_eq!(d.predicted_writes(), vec![1, 2, 3, 4]);
        // The next step has begun (its first two launches): the backward's and the optimizer's
        // writes come next, then the forward's.
        for (kernel, w) in &step[..2] {
            d.record_launch(&k(*kernel, "k"), 7, &[], &[buf(*w)]);
        }
        assert_eq!(d.predicted_writes(), vec![3, 4, 1, 2]);
        // The same kernel writing other buffers is another point of the loop.
        d.record_launch(&k(3, "k"), 7, &[], &[buf(9)]);
        assert_eq!(d.predicted_writes()[0], 1, "{:?}", d.predicted_writes());
    }

    #[test]
    fn window_slides_and_first_use() {
        let mut d = Dag::new(3);
        for i in 0..10u64 {
            d.record_launch(&k(10, "w"), 1, &[buf(i % 4)], &[buf((i + 1) % 4)]);
        }
        assert_eq!(d.window_len(), 3);
        let j = d.to_json();
        let seqs: Vec<u64> = j["window"]["launches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["seq"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, vec![7, 8, 9]);
        for dep in deps(&d) {
            assert!(dep.0 >= 7 && dep.0 < dep.1, "{dep:?}");
        }
        // Launch 7 reads 3, writes 0; 8 reads 0, writes 1; 9 reads 1, writes 2.
        assert_eq!(d.buffer_first_use(), vec![3, 0, 1, 2]);
        // Aggregate history is kept whole.
        assert_eq!(d.to_json()["kernels"][0]["launches"], 10);
        let d0 = Dag::new(0);
        assert_eq!(d0.window_len(), 0);
        assert!(d0.is_acyclic_window());
    }

    #[test]
    fn dot_escapes_names_and_styles_edges() {
        let mut d = Dag::new(4);
        let name = r#"_ZN3foo"bar\baz"#;
        d.record_launch(
            &KernelRef {
                handle: 0x77,
                name: Some(name),
                opaque: true,
            },
            0,
            &[buf(1)],
            &[buf(2)],
        );
        let dot = d.to_dot();
        assert!(dot.starts_with("digraph possum {"), "{dot}");
        assert!(
            dot.contains(r#"label="_ZN3foo\"bar\\baz\n1 launches (opaque)""#),
            "{dot}"
        );
        assert!(dot.contains("k119 [shape=box,style=filled"), "{dot}");
        assert!(
            dot.contains("b1 [shape=ellipse,label=\"buffer 1\\n8.0 KiB\"]"),
            "{dot}"
        );
        assert!(
            dot.contains("b1 -> k119 [style=dashed,label=\"1\"]"),
            "{dot}"
        );
        assert!(dot.contains("k119 -> b2 [label=\"1\"]"), "{dot}");
        assert!(dot.trim_end().ends_with('}'));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_size(512), "512 B");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(3 << 30), "3.0 GiB");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Launch {
            kernel: u64,
            stream: u64,
            reads: Vec<u64>,
            writes: Vec<u64>,
        },
        Free(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0u64..4, 0u64..3, prop::collection::vec(0u64..8, 0..4), prop::collection::vec(0u64..8, 0..3))
                .prop_map(|(kernel, stream, reads, writes)| Op::Launch { kernel, stream, reads, writes }),
            1 => (0u64..8).prop_map(Op::Free),
        ]
    }

    proptest! {
        #[test]
        fn window_is_acyclic_and_raw_complete(window in 1usize..12, ops in prop::collection::vec(op(), 0..80)) {
            let mut d = Dag::new(window);
            // Naive model: full history of (seq, reads, writes) and free points.
            let mut history: Vec<(Vec<u64>, Vec<u64>)> = Vec::new();
            let mut last_write: HashMap<u64, usize> = HashMap::default();
            let mut expected_raw: Vec<(u64, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Launch { kernel, stream, reads, writes } => {
                        let seq = history.len();
                        for r in &reads {
                            if let Some(&w) = last_write.get(r) {
                                expected_raw.push((w as u64, seq as u64));
                            }
                        }
                        for w in &writes {
                            last_write.insert(*w, seq);
                        }
                        let rb: Vec<BufRef> = reads.iter().map(|&i| buf(i)).collect();
                        let wb: Vec<BufRef> = writes.iter().map(|&i| buf(i)).collect();
                        d.record_launch(&KernelRef { handle: 100 + kernel, name: None, opaque: false }, stream, &rb, &wb);
                        history.push((reads, writes));
                    }
                    Op::Free(id) => {
                        last_write.remove(&id);
                        d.record_free(id);
                    }
                }
                prop_assert!(d.window_len() <= window);
            }
            prop_assert!(d.is_acyclic_window());
            let got: HashSet<(u64, u64, DepKind)> = deps(&d).into_iter().collect();
            let oldest = history.len().saturating_sub(window) as u64;
            for (f, t) in expected_raw {
                if f >= oldest && f != t {
                    prop_assert!(got.contains(&(f, t, DepKind::Raw)), "missing RAW {} -> {}", f, t);
                }
            }
            for &(f, t, _) in &got {
                prop_assert!(f < t && f >= oldest);
            }
            let first = d.buffer_first_use();
            let uniq: HashSet<_> = first.iter().collect();
            prop_assert_eq!(uniq.len(), first.len());
        }
    }
}
