"""Measurements that choose DocTune's defaults (run by hand; they print figures)."""
