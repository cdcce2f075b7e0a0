package testenv

import (
	"context"
	"net"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestStartPostgresOnATakenPort hands StartPostgres a port that another
// process holds, as happens when a parallel package's server or outgoing
// connection takes it after FreePort looked: the cluster starts on another
// port instead of failing the test that wanted it.
func TestStartPostgresOnATakenPort(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	takenPort := taken.Addr().(*net.TCPAddr).Port
	handed := false
	freePort = func() (int, error) {
		if !handed {
			handed = true
			return takenPort, nil
		}
		return FreePort()
	}
	defer func() { freePort = FreePort }()
	pg, err := StartPostgres()
	if err != nil {
		t.Fatalf("start on a taken port: %v", err)
	}
	defer pg.Close()
	if pg.Port() == takenPort {
		t.Fatalf("the cluster reports the taken port %d", takenPort)
	}
	conn, err := pgx.Connect(context.Background(), pg.AdminURL)
	if err != nil {
		t.Fatalf("connect to %s: %v", pg.AdminURL, err)
	}
	_ = conn.Close(context.Background())
}
