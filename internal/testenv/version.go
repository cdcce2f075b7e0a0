package testenv

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Environment variables that choose the PostgreSQL server of private
// clusters. Packages never read them; only the harness does.
const (
	// EnvPGVersion selects the major version of private clusters ("15",
	// "17"). Unset: the newest server found on the host.
	EnvPGVersion = "OUTBOX_TEST_PG_VERSION"
	// EnvPGRoot is a root filesystem holding the server binaries (prepared
	// by scripts/pg17-root.sh); the harness runs them there with chroot.
	// Unset: DefaultPGRoot when the host lacks the version asked for.
	EnvPGRoot = "OUTBOX_TEST_PG_ROOT"
	// DefaultPGRoot is where scripts/pg17-root.sh prepares PostgreSQL 17.
	DefaultPGRoot = "/var/cache/outbox-relay/pg17-trixie"
)

// pgServer is where a private cluster's binaries come from.
type pgServer struct {
	major int    // major version of the binaries
	bin   string // directory of initdb, pg_ctl and postgres, as the server sees it
	root  string // chroot directory; "" for the host's binaries
}

// describe says where the binaries come from, for the harness's log line.
func (s pgServer) describe() string {
	if s.root == "" {
		return s.bin
	}
	return s.bin + " in root " + s.root
}

// selectServer reads EnvPGVersion and EnvPGRoot and finds the binaries.
func selectServer() (pgServer, error) {
	want := strings.TrimSpace(os.Getenv(EnvPGVersion))
	root := strings.TrimSpace(os.Getenv(EnvPGRoot))
	if want == "" && root == "" {
		bin, err := FindPGBin()
		if err != nil {
			return pgServer{}, err
		}
		return pgServer{major: binMajor(bin), bin: bin}, nil
	}
	if want != "" {
		if _, err := strconv.Atoi(want); err != nil {
			return pgServer{}, fmt.Errorf("%s=%q: want a major version such as 15 or 17", EnvPGVersion, want)
		}
	}
	if root == "" {
		bin := "/usr/lib/postgresql/" + want + "/bin"
		if isFile(filepath.Join(bin, "initdb")) {
			return pgServer{major: binMajor(bin), bin: bin}, nil
		}
		root = DefaultPGRoot
	}
	if want == "" {
		bins := versionDirs(root)
		if len(bins) == 0 {
			return pgServer{}, fmt.Errorf("%s=%s holds no /usr/lib/postgresql/*/bin/initdb: prepare it with scripts/pg17-root.sh prepare", EnvPGRoot, root)
		}
		want = filepath.Base(filepath.Dir(bins[0]))
	}
	s := pgServer{bin: "/usr/lib/postgresql/" + want + "/bin", root: root}
	s.major, _ = strconv.Atoi(want)
	if !isFile(filepath.Join(root, s.bin, "initdb")) {
		return pgServer{}, fmt.Errorf("PostgreSQL %s is neither on the host (/usr/lib/postgresql/%s/bin) nor in root %s: prepare the root with `scripts/pg17-root.sh prepare` (as root), or set %s to one that has it", want, want, root, EnvPGRoot)
	}
	if os.Geteuid() != 0 {
		return pgServer{}, fmt.Errorf("PostgreSQL %s lives in root %s, and only root may chroot there: run the tests as root (scripts/pg17-root.sh run ...)", want, root)
	}
	if !isFile(filepath.Join(root, "proc/self/status")) || !isFile(filepath.Join(root, "dev/null")) {
		return pgServer{}, fmt.Errorf("root %s lacks /proc or /dev: run the tests under `scripts/pg17-root.sh run CMD...`, which mounts them", root)
	}
	return s, nil
}

// versionDirs lists root's /usr/lib/postgresql/*/bin holding initdb, the
// newest first.
func versionDirs(root string) []string {
	dirs, _ := filepath.Glob(filepath.Join(root, "/usr/lib/postgresql/*/bin"))
	sort.Slice(dirs, func(i, j int) bool { return binMajor(dirs[i]) > binMajor(dirs[j]) })
	var out []string
	for _, d := range dirs {
		if isFile(filepath.Join(d, "initdb")) {
			out = append(out, d)
		}
	}
	return out
}

// binMajor reads the major version from a Debian path
// /usr/lib/postgresql/N/bin; 0 when the path has another form.
func binMajor(bin string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(bin)))
	return n
}

func isFile(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// owner returns the uid and gid that run the server: the chroot's or the
// host's "postgres" user when the tests run as root, else the current user
// (ok false: no chown needed).
func (s pgServer) owner() (uid, gid int, ok bool, err error) {
	if os.Geteuid() != 0 {
		return 0, 0, false, nil
	}
	if s.root == "" {
		u, err := user.Lookup("postgres")
		if err != nil {
			return 0, 0, false, fmt.Errorf("running as root needs the \"postgres\" OS user to run PostgreSQL (useradd --system postgres): %w", err)
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		return uid, gid, true, nil
	}
	uid, gid, err = passwdEntry(filepath.Join(s.root, "etc/passwd"), "postgres")
	if err != nil {
		return 0, 0, false, fmt.Errorf("root %s: %w (prepare it with scripts/pg17-root.sh prepare)", s.root, err)
	}
	return uid, gid, true, nil
}

// passwdEntry looks name up in a passwd file of another root filesystem,
// which os/user cannot read.
func passwdEntry(path, name string) (uid, gid int, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Split(sc.Text(), ":")
		if len(fields) >= 4 && fields[0] == name {
			uid, err1 := strconv.Atoi(fields[2])
			gid, err2 := strconv.Atoi(fields[3])
			if err1 != nil || err2 != nil {
				return 0, 0, fmt.Errorf("%s: bad entry for %q", path, name)
			}
			return uid, gid, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, 0, err
	}
	return 0, 0, fmt.Errorf("%s has no user %q", path, name)
}

// command builds the command that runs tool with args as the server's
// owner: directly, through runuser, or through chroot into the root.
// Arguments naming a path below the root are given as the server sees
// them.
func (s pgServer) command(uid, gid int, asOwner bool, tool string, args ...string) *exec.Cmd {
	if s.root == "" {
		path := filepath.Join(s.bin, tool)
		if asOwner {
			return exec.Command("runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
		}
		return exec.Command(path, args...)
	}
	inner := make([]string, 0, len(args)+8)
	inner = append(inner, "--userspec="+strconv.Itoa(uid)+":"+strconv.Itoa(gid), s.root,
		"/usr/bin/env", "-i", "PATH=/usr/bin:/bin", "HOME=/var/lib/postgresql", "LC_ALL=C",
		filepath.Join(s.bin, tool))
	for _, a := range args {
		inner = append(inner, s.inside(a))
	}
	return exec.Command("chroot", inner...)
}

// inside returns path as the chrooted server sees it.
func (s pgServer) inside(path string) string {
	if s.root == "" {
		return path
	}
	if rel, ok := strings.CutPrefix(path, strings.TrimSuffix(s.root, "/")+"/"); ok {
		return "/" + rel
	}
	return path
}

// tempBase is where private clusters' directories go: the chroot's /tmp,
// so the chrooted server can reach them.
func (s pgServer) tempBase() string {
	if s.root == "" {
		return ""
	}
	return filepath.Join(s.root, "tmp")
}

// Major returns the major version of a private cluster's binaries (0 for an
// external server; ask it with ServerVersionNum).
func (p *Postgres) Major() int { return p.server.major }

// ServerVersionNum returns the server's server_version_num, e.g. 170012.
func (p *Postgres) ServerVersionNum(ctx context.Context) (int, error) {
	conn, err := pgx.Connect(ctx, p.AdminURL)
	if err != nil {
		return 0, fmt.Errorf("connect to %s: %w", redactURL(p.AdminURL), err)
	}
	defer conn.Close(ctx)
	var v int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&v); err != nil {
		return 0, err
	}
	return v, nil
}

// describeServer is the harness's log line about the server in use.
func (p *Postgres) describeServer(ctx context.Context) string {
	var version string
	conn, err := pgx.Connect(ctx, p.AdminURL)
	if err == nil {
		_ = conn.QueryRow(ctx, "SHOW server_version").Scan(&version)
		conn.Close(ctx)
	}
	if version == "" {
		version = "(version unknown)"
	}
	if p.external {
		return fmt.Sprintf("PostgreSQL %s, external server %s", version, redactURL(p.AdminURL))
	}
	return fmt.Sprintf("PostgreSQL %s, private cluster from %s", version, p.server.describe())
}

// importFile copies a file that a setting names ('/path', for example a TLS
// certificate in a test's temporary directory) into dir when the server runs
// in a root that cannot see it, and returns the setting as the server must
// read it. Other values are returned unchanged.
func (p *Postgres) importFile(dir, value string) (string, error) {
	path, ok := strings.CutPrefix(value, "'")
	path, ok2 := strings.CutSuffix(path, "'")
	if p.server.root == "" || !ok || !ok2 || !filepath.IsAbs(path) || p.server.inside(path) != path || !isFile(path) {
		return value, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	dst := filepath.Join(dir, filepath.Base(path))
	if err := os.WriteFile(dst, b, 0o600); err != nil {
		return "", err
	}
	if err := p.chown(dir); err != nil {
		return "", err
	}
	return "'" + p.server.inside(dst) + "'", nil
}

// PGMajor returns the major version private clusters will run
// (OUTBOX_TEST_PG_VERSION, else the host's newest), without starting one:
// tests that need a version skip before they start servers.
func PGMajor() (int, error) {
	s, err := selectServer()
	if err != nil {
		return 0, err
	}
	return s.major, nil
}
