package connlimit

import (
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// ShedListener bounds the connections of a listener serving short requests
// (health probes, scrapes) without ever making a newcomer wait: at max open
// connections, a new one displaces an open one that is not serving a request
// (Serving marks those): the oldest of the source holding the most such
// connections. Connections that sit idle cannot
// starve a probe, which sends its request at once and is served before many
// newer connections arrive; a flood from one address displaces only its own
// connections while it holds the most. A limit that makes newcomers wait
// (golang.org/x/net/netutil.LimitListener) lets 300 idle connections hold
// a health port until the kubelet gives up and restarts the pod.
type ShedListener struct {
	net.Listener
	max   int
	mu    sync.Mutex
	conns map[*shedConn]struct{}
	shed  atomic.Uint64
}

// Shed wraps ln with at most max open connections (max > 0).
func Shed(ln net.Listener, max int) *ShedListener {
	return &ShedListener{Listener: ln, max: max, conns: map[*shedConn]struct{}{}}
}

// Shed returns how many connections were displaced or refused.
func (s *ShedListener) Shed() uint64 { return s.shed.Load() }

type shedConn struct {
	net.Conn
	s       *ShedListener
	src     netip.Addr
	at      time.Time
	serving int // under s.mu
	once    sync.Once
}

func (c *shedConn) Close() error {
	c.once.Do(func() {
		c.s.mu.Lock()
		delete(c.s.conns, c)
		c.s.mu.Unlock()
	})
	return c.Conn.Close()
}

// Accept implements net.Listener; it waits only for a connection.
func (s *ShedListener) Accept() (net.Conn, error) {
	for {
		c, err := accept(s.Listener)
		if err != nil {
			return nil, err
		}
		sc := &shedConn{Conn: c, s: s, at: time.Now()}
		if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
			sc.src, _ = netip.AddrFromSlice(ta.IP)
			sc.src = sc.src.Unmap()
		}
		s.mu.Lock()
		var victim *shedConn
		if len(s.conns) >= s.max {
			victim = s.victim()
			if victim == nil { // all serving requests: the newcomer goes
				s.mu.Unlock()
				s.shed.Add(1)
				c.Close()
				continue
			}
			delete(s.conns, victim)
		}
		s.conns[sc] = struct{}{}
		s.mu.Unlock()
		if victim != nil {
			s.shed.Add(1)
			victim.Conn.Close() // its server's read fails, and it closes it
		}
		return sc, nil
	}
}

// victim is the connection to displace, nil when all are serving. Called
// with mu held; max is small, so a scan is cheap.
func (s *ShedListener) victim() *shedConn {
	count := map[netip.Addr]int{}
	for c := range s.conns {
		if c.serving == 0 {
			count[c.src]++
		}
	}
	var heavy netip.Addr
	most := 0
	for src, n := range count {
		if n > most {
			heavy, most = src, n
		}
	}
	var oldest *shedConn
	for c := range s.conns {
		if c.serving == 0 && c.src == heavy && (oldest == nil || c.at.Before(oldest.at)) {
			oldest = c
		}
	}
	return oldest
}

// Serving marks c, a connection this listener accepted, as serving a request
// until done is called: it is not displaced meanwhile. Other connections are
// ignored (done does nothing).
func (s *ShedListener) Serving(c net.Conn) (done func()) {
	sc, ok := c.(*shedConn)
	if !ok || sc.s != s {
		return func() {}
	}
	s.mu.Lock()
	sc.serving++
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		sc.serving--
		s.mu.Unlock()
	}
}
