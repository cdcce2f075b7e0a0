package testenv

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Cluster is a NATS cluster of embedded JetStream servers on loopback, each
// with its own store directory, so a test can kill one node (Stop) and
// bring it back (Start) with its data, as a real node restart does.
type Cluster struct {
	// Nodes are the cluster's servers; Nodes[i].Stop and Nodes[i].Start
	// kill and restart one.
	Nodes []*NATS
	// Names are the nodes' server names (n0, n1, ...), as stream info
	// reports its leader and replicas.
	Names []string
}

// StartCluster starts n JetStream servers that form one cluster and waits
// until JetStream has a meta leader. opts apply to every node.
func StartCluster(n int, opts ...NATSOption) (*Cluster, error) {
	if n < 1 {
		return nil, fmt.Errorf("cluster of %d nodes", n)
	}
	routePorts := make([]int, n)
	for i := range routePorts {
		p, err := FreePort()
		if err != nil {
			return nil, err
		}
		routePorts[i] = p
	}
	var routes []string
	for _, p := range routePorts {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", p))
	}
	c := &Cluster{}
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("n%d", i)
		node := append([]NATSOption{func(o *server.Options) {
			o.ServerName = name
			o.Cluster = server.ClusterOpts{Name: "outbox-test", Host: "127.0.0.1", Port: routePorts[i]}
			o.Routes = server.RoutesFromStr(strings.Join(routes, ","))
		}}, opts...)
		s, err := StartNATS(node...)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("cluster node %s: %w", name, err)
		}
		c.Nodes = append(c.Nodes, s)
		c.Names = append(c.Names, name)
	}
	if err := c.WaitReady(60 * time.Second); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// URL returns the client URLs of every node, comma-separated, as a client
// that must survive the loss of any one node is configured.
func (c *Cluster) URL() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL
	}
	return strings.Join(urls, ",")
}

// WaitReady waits until a JetStream API call through the cluster succeeds
// (a meta leader is elected and a quorum of nodes is up).
func (c *Cluster) WaitReady(timeout time.Duration) error {
	nc, err := nats.Connect(c.URL(), nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	var last error
	if WaitFor(timeout, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, last = js.AccountInfo(ctx)
		return last == nil
	}) {
		return nil
	}
	return fmt.Errorf("jetstream cluster not ready within %s: %v", timeout, last)
}

// Index returns the position in Nodes of the server called name, or -1.
func (c *Cluster) Index(name string) int {
	for i, n := range c.Names {
		if n == name {
			return i
		}
	}
	return -1
}

// StreamLeader returns the index of the node leading stream.
func (c *Cluster) StreamLeader(ctx context.Context, js jetstream.JetStream, stream string) (int, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return -1, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return -1, err
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return -1, fmt.Errorf("stream %s has no leader", stream)
	}
	i := c.Index(info.Cluster.Leader)
	if i < 0 {
		return -1, fmt.Errorf("stream %s leader %q is not a node of the cluster", stream, info.Cluster.Leader)
	}
	return i, nil
}

// Close stops every node and removes their stores.
func (c *Cluster) Close() {
	for _, n := range c.Nodes {
		n.Close()
	}
}
