package testenv

import (
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Direction selects which way of a proxied connection a stall affects.
type Direction int

// Directions of a proxied connection.
const (
	// Upstream is client → server (for the relay: queries, publishes).
	Upstream Direction = 1 << iota
	// Downstream is server → client (WAL, keepalives, JetStream acks).
	Downstream
	// Both directions: a network partition.
	Both = Upstream | Downstream
)

// Proxy is a TCP proxy on 127.0.0.1 between a client under test and one
// server. Fault tests point the relay at Proxy.Addr and then cut, stall or
// slow its connections the way real networks do:
//
//   - Cut resets every current connection (the peer sees ECONNRESET at once).
//   - Stall stops forwarding in one or both directions, for current and new
//     connections, until Heal: no FIN, no RST, bytes just stop (a partition,
//     a stuck load balancer). New connections are accepted but carry nothing.
//   - Blackhole stops forwarding on the current connections for good while
//     new ones work: a peer that vanished behind a stateful firewall or NAT,
//     which only timeouts and keepalives can detect.
//   - SetLatency delays every chunk of bytes in both directions.
type Proxy struct {
	// Addr is host:port for clients.
	Addr string

	target   string
	ln       net.Listener
	accepted atomic.Int64

	mu      sync.Mutex
	cond    *sync.Cond
	conns   map[*proxyConn]struct{}
	stalled Direction
	holeNew bool // new connections are blackholed
	latency time.Duration
	closed  bool
	wg      sync.WaitGroup
}

type proxyConn struct {
	client, server net.Conn
	blackholed     bool
	closed         bool
	// ends counts the sides (client, server) that ended on a blackholed
	// connection: each side's close is lost on the way, so the other side
	// stays open until its own peer gives up.
	ends int
}

// StartProxy listens on a free loopback port and forwards each accepted
// connection to target (host:port).
func StartProxy(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("proxy listen: %w", err)
	}
	p := &Proxy{Addr: ln.Addr().String(), target: target, ln: ln, conns: map[*proxyConn]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// Port returns the proxy's port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Accepted returns how many connections the proxy has accepted so far; a
// client that detected a dead connection shows up as a new one.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// Active returns the number of connections currently open through the proxy.
func (p *Proxy) Active() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Cut resets every current connection; new connections are served.
func (p *Proxy) Cut() {
	p.mu.Lock()
	conns := make([]*proxyConn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		p.closeConn(c, true)
	}
}

// Stall stops forwarding in direction d on current and new connections
// until Heal. Bytes already read by the proxy wait; the kernel buffers fill
// and the sender blocks, as on a real partition.
func (p *Proxy) Stall(d Direction) {
	p.mu.Lock()
	p.stalled |= d
	p.mu.Unlock()
}

// Heal resumes forwarding after Stall. Blackholed connections stay dead.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.stalled = 0
	p.cond.Broadcast()
	p.mu.Unlock()
}

// Blackhole stops forwarding on every current connection for good;
// connections opened afterwards work. Nothing crosses a blackholed
// connection, not even a close: when the client gives up on it the server
// side stays open until the server times it out (and the other way round),
// as when a peer vanishes behind a stateful firewall.
func (p *Proxy) Blackhole() {
	p.mu.Lock()
	for c := range p.conns {
		c.blackholed = true
	}
	p.cond.Broadcast()
	p.mu.Unlock()
}

// BlackholeNew makes connections opened from now on (while on) reach
// nothing: the client's connect succeeds, then every byte it sends is
// dropped and nothing ever answers. A client without connect and handshake
// timeouts hangs on such a connection for good. Such connections stay dead
// after BlackholeNew(false); only the client giving up ends them.
func (p *Proxy) BlackholeNew(on bool) {
	p.mu.Lock()
	p.holeNew = on
	p.mu.Unlock()
}

// SetLatency delays each forwarded chunk by d (0 removes the delay).
func (p *Proxy) SetLatency(d time.Duration) {
	p.mu.Lock()
	p.latency = d
	p.mu.Unlock()
}

// Close stops listening, closes every connection and waits for the
// proxy's goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.stalled = 0
	p.cond.Broadcast()
	p.mu.Unlock()
	_ = p.ln.Close()
	p.Cut()
	p.wg.Wait()
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		hole := p.holeNew
		p.mu.Unlock()
		p.accepted.Add(1)
		p.wg.Add(1)
		go p.serve(c, hole)
	}
}

func (p *Proxy) serve(client net.Conn, hole bool) {
	defer p.wg.Done()
	pc := &proxyConn{client: client}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = client.Close()
		return
	}
	p.conns[pc] = struct{}{}
	if hole {
		pc.blackholed = true
		p.mu.Unlock()
		defer p.closeConn(pc, false)
		buf := make([]byte, 4096)
		for {
			if _, err := client.Read(buf); err != nil {
				return
			}
		}
	}
	// During a partition a new connection is accepted (the client's
	// connect succeeds) but reaches nothing until the network heals.
	for p.stalled&Upstream != 0 && !pc.closed {
		p.cond.Wait()
	}
	closed := pc.closed
	p.mu.Unlock()
	if closed {
		return
	}
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		p.closeConn(pc, true)
		return
	}
	p.mu.Lock()
	pc.server = server
	closed = pc.closed
	p.mu.Unlock()
	if closed {
		_ = server.Close()
		return
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.pipe(pc, client, server, Upstream) }()
	go func() { defer wg.Done(); p.pipe(pc, server, client, Downstream) }()
	wg.Wait()
}

// pipe copies src to dst until either side fails, honouring stalls and
// latency, then closes the whole connection (only src's side when the
// connection is blackholed).
func (p *Proxy) pipe(pc *proxyConn, src, dst net.Conn, d Direction) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			lat, forward, open := p.gate(pc, d)
			if !open {
				return
			}
			if lat > 0 {
				time.Sleep(lat)
			}
			if forward {
				if _, werr := dst.Write(buf[:n]); werr != nil && !p.isBlackholed(pc) {
					p.closeConn(pc, false)
					return
				}
			}
		}
		if err != nil {
			break // EOF or reset
		}
	}
	p.mu.Lock()
	hole := pc.blackholed && !pc.closed
	p.mu.Unlock()
	if !hole {
		p.closeConn(pc, false)
		return
	}
	_ = src.Close()
	p.mu.Lock()
	pc.ends++
	last := pc.ends == 2
	p.mu.Unlock()
	if last {
		p.closeConn(pc, false)
	}
}

func (p *Proxy) isBlackholed(pc *proxyConn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return pc.blackholed
}

// gate blocks while d is stalled. It returns the latency to apply, whether
// to forward the chunk (a blackholed connection drops it, so the pipe keeps
// reading and notices when the client finally closes), and false once the
// connection is closed.
func (p *Proxy) gate(pc *proxyConn, d Direction) (lat time.Duration, forward, open bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for !pc.closed && !pc.blackholed && p.stalled&d != 0 {
		p.cond.Wait()
	}
	return p.latency, !pc.blackholed, !pc.closed
}

func (p *Proxy) closeConn(pc *proxyConn, reset bool) {
	p.mu.Lock()
	if pc.closed {
		p.mu.Unlock()
		return
	}
	pc.closed = true
	delete(p.conns, pc)
	p.cond.Broadcast()
	server := pc.server
	p.mu.Unlock()
	for _, c := range []net.Conn{pc.client, server} {
		if c == nil {
			continue
		}
		if tc, ok := c.(*net.TCPConn); ok && reset {
			// Linger 0: close sends RST, the way a crashed middlebox or a
			// killed peer ends a connection.
			_ = tc.SetLinger(0)
		}
		_ = c.Close()
	}
}
