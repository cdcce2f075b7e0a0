package testenv

import (
	"fmt"
	"os"
	"path/filepath"
)

// SetHBA replaces the pg_hba.conf of a private cluster with rules (one
// rule a line, as in the file) and reloads the server. Security tests use
// it to require TLS and passwords for the roles under test while the
// harness's own superuser keeps trusted access.
func (p *Postgres) SetHBA(rules string) error {
	if p.external {
		return fmt.Errorf("cannot change pg_hba.conf of an external PostgreSQL server")
	}
	path := filepath.Join(p.dataDir, "pg_hba.conf")
	if err := os.WriteFile(path, []byte(rules), 0o600); err != nil {
		return err
	}
	if err := p.chown(path); err != nil {
		return err
	}
	if out, err := p.run("pg_ctl", "-D", p.dataDir, "reload"); err != nil {
		return fmt.Errorf("pg_ctl reload: %w\n%s", err, out)
	}
	return nil
}
