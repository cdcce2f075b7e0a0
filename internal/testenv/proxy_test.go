package testenv

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"
)

// echoServer answers every line with the same line.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	return ln.Addr().String()
}

// roundTrip writes a line and reads the echo, within timeout.
func roundTrip(c net.Conn, r *bufio.Reader, timeout time.Duration) error {
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	_, err := r.ReadString('\n')
	return err
}

func TestProxyFaults(t *testing.T) {
	p, err := StartProxy(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	dial := func() (net.Conn, *bufio.Reader) {
		c, err := net.Dial("tcp", p.Addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c, bufio.NewReader(c)
	}
	c, r := dial()
	if err := roundTrip(c, r, time.Second); err != nil {
		t.Fatalf("through the proxy: %v", err)
	}

	// Cut: the client sees the connection end at once.
	p.Cut()
	if err := roundTrip(c, r, time.Second); err == nil {
		t.Fatal("a cut connection still works")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("a cut connection timed out instead of failing at once")
	}

	// Stall and heal: nothing passes, then everything does.
	c, r = dial()
	if err := roundTrip(c, r, time.Second); err != nil {
		t.Fatal(err)
	}
	p.Stall(Both)
	if err := roundTrip(c, r, 200*time.Millisecond); err == nil {
		t.Fatal("a stalled connection answered")
	}
	p.Heal()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if _, err := r.ReadString('\n'); err != nil {
		t.Fatalf("after Heal the held line did not arrive: %v", err)
	}

	// Blackhole: the old connection is dead for good, new ones work.
	p.Blackhole()
	if err := roundTrip(c, r, 200*time.Millisecond); err == nil {
		t.Fatal("a blackholed connection answered")
	}
	c2, r2 := dial()
	if err := roundTrip(c2, r2, time.Second); err != nil {
		t.Fatalf("a new connection after Blackhole: %v", err)
	}

	// BlackholeNew: new connections reach nothing, even after it ends.
	p.BlackholeNew(true)
	c3, r3 := dial()
	if !WaitFor(time.Second, func() bool { return p.Accepted() == 4 }) {
		t.Fatal("the proxy did not accept the connection")
	}
	p.BlackholeNew(false)
	if err := roundTrip(c3, r3, 200*time.Millisecond); err == nil {
		t.Fatal("a connection opened during BlackholeNew answered")
	}

	// Latency delays each chunk.
	p.SetLatency(100 * time.Millisecond)
	start := time.Now()
	if err := roundTrip(c2, r2, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Fatalf("round trip with 100 ms latency each way took %s", d)
	}
	if p.Accepted() != 4 {
		t.Fatalf("Accepted = %d, want 4", p.Accepted())
	}
}

func TestCerts(t *testing.T) {
	c, err := NewCerts(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{c.CAFile, c.ServerCert, c.ServerKey, c.ClientCert, c.ClientKey} {
		if f == "" {
			t.Fatal("missing file name")
		}
	}
	if _, err := WithNATSTLS(c, true); err != nil {
		t.Fatalf("certificates unusable for a TLS server: %v", err)
	}
}
