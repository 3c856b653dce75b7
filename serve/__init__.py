"""g4.serve"""
