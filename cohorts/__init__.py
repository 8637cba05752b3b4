"""cohorts"""
