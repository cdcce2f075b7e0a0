package replication

import (
	"errors"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
)

func parseLSN(s string) (LSN, error) { return pglogrepl.ParseLSN(s) }

// ParseLSN parses PostgreSQL's text form of an LSN, e.g. "0/16B3748".
func ParseLSN(s string) (LSN, error) { return pglogrepl.ParseLSN(s) }

// redactErr keeps passwords out of URL parse errors, which quote the input.
func redactErr(err error) error {
	var pe *pgconn.ParseConfigError
	if errors.As(err, &pe) {
		return errors.New(strings.TrimSpace("cannot parse connection string: " + pe.Unwrap().Error()))
	}
	return err
}
