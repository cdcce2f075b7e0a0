package replication

import "testing"

func TestFormatLSNMatchesString(t *testing.T) {
	for _, lsn := range []LSN{0, 1, 0xF, 0x10, 0x16B3748, 0x16_B374D848, 0xFFFFFFFF, 0x1_00000000, 1<<64 - 1} {
		if got, want := FormatLSN(lsn), lsn.String(); got != want {
			t.Errorf("FormatLSN(%d) = %q, want %q", uint64(lsn), got, want)
		}
	}
}

func BenchmarkFormatLSN(b *testing.B) {
	b.ReportAllocs()
	for i := range b.N {
		_ = FormatLSN(LSN(0x16_B374D848 + i))
	}
}
