package config

import (
	"strings"
	"testing"
)

func TestPingKnobs(t *testing.T) {
	c := Default()
	if c.PingIntervalSecs != DefaultPingInterval || c.PingTimeoutSecs != DefaultPingTimeout {
		t.Errorf("Default() ping = %d/%d, want %d/%d", c.PingIntervalSecs, c.PingTimeoutSecs, DefaultPingInterval, DefaultPingTimeout)
	}
	got, err := Parse([]byte(`{"ping_interval_secs": 3, "ping_timeout_secs": 7}`))
	if err != nil || got.PingIntervalSecs != 3 || got.PingTimeoutSecs != 7 {
		t.Errorf("Parse = %+v, %v; want ping 3/7", got, err)
	}
	_, err = Parse([]byte(`{"ping_interval_secs": 0, "ping_timeout_secs": -1}`))
	if err == nil || !strings.Contains(err.Error(), "ping_interval_secs: 0") || !strings.Contains(err.Error(), "ping_timeout_secs: -1") {
		t.Errorf("Parse of bad ping knobs = %v, want both keys named", err)
	}
}
