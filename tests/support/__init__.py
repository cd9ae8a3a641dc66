"""Test helpers shared by the test tiers (fake servers, fixtures)."""
